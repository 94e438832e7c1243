"""How the weights are held at run time (float or packed low-bit codes) and loading a model into them."""
