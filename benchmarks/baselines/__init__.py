"""Strong plain-PyTorch baselines, written as a competent user would, importing nothing from
Sluice: every time-to-accuracy comparison runs against them."""
