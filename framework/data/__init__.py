"""Prompts: the built-in suite and calibration set, any JSONL file in Spec-Bench's format, chat
encoding, and Spec-Bench answer files."""
