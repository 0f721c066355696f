"""Built-in models. Any model works if its forward takes a batch and returns the scalar loss."""
