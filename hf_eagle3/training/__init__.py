"""Training an EAGLE-3 draft: the data a target is distilled on (`data`), the draft vocabulary (`vocab`), the
training-time test (`ttt`), and the training loop with its command (`trainer`)."""
