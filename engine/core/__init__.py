"""Scheduling state without torch: scheduler, block manager, sequences, stopping, detokenizer, outputs."""
