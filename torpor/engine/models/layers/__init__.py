"""Building blocks of the decoder models. Each layer owns the loading of its weights."""
