"""Pretraining (SFT) of a tiny model on ShapesWorld: the base model of the CPU learning benchmark."""
