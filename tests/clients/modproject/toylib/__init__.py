"""The project's library: a model builder (nanochat's ``nanochat`` package, torchtitan's ``torchtitan``)."""
