"""The reproducible toy build: corpus and tokenizer (data), the pair's training (train, its settings in config),
the pruned target (pruned), evaluation sets (evalsets), the pair's evaluation (evaluate) and fit_map."""
