"""What drafters compose: the step-by-step draft builder and the n-gram index of copying drafters
(`framework.drafting.builder`), the reduced draft head and compressed draft weights as drafter
options (`framework.drafting.draft_vocab`), and the draft gate that declines rounds that do not pay
(`framework.drafting.gate`)."""
