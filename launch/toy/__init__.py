"""The reproducible toy build: corpus and tokenizer (data), the pair's training (train, its settings in config),
the pruned target (pruned), evaluation sets (evalsets) and the pair's evaluation (evaluate)."""
