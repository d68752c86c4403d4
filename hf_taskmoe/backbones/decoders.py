"""The decoder-only and encoder-decoder architectures task-level routing runs on, each declared once
(filled in by the task-routed causal-LM / T5 family)."""
