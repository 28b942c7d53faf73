"""What drafters compose: the n-gram index of copying drafters (`framework.drafting.copying`), the
reduced draft head and compressed draft weights as drafter options
(`framework.drafting.draft_vocab`), and the draft gate that declines rounds that do not pay
(`framework.drafting.gate`). Each draft step's token is the engine's to choose
(`framework.engine.draft_steps`)."""
