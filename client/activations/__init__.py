"""From examples to attention-head activations: chunks, hooks, fixed-shape passes, scores."""
