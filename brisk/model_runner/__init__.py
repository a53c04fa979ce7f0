"""The model side of one rank: interface.py is what the rest of brisk sees of it, setup.load_model_runner builds it,
runner.py runs its steps."""
