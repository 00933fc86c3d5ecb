"""Activation compression: the codec and the per-module saved-tensor hooks."""
