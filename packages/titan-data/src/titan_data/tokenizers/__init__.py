"""Tokenizers behind one interface."""
