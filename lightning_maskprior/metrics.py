"""The TensorBoard tags that are logged in one place and read by name in others (the study's tables and figures,
the benchmarks, the tests): each written once, here. Imports nothing, so the study's command stays fast."""

#: PriorPersistence's summaries (means over layers and heads) and its per layer/head series.
PERSISTENCE = "persistence"
PERSISTENCE_HEADS = "persistence_heads"

#: Mean open mass now / mean open mass at step 0 (arXiv 2608.00418's persistence score).
SCORE = f"{PERSISTENCE}/score"
#: The first step at which the score fell below 0.5, logged once.
HALF_LIFE = f"{PERSISTENCE}/half_life"
#: Mean attention mass on the structure's open entries.
OPEN_MASS = f"{PERSISTENCE}/open_mass"
