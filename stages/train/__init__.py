"""Selected batches → a trained model: the config, the loop, evaluation, gradient
communication, and launching the loop under torchrun."""
