"""The Flax decoder, ModelConfig, weight loading and its cache. Installed as jaxserve.models."""

if __name__ == "models":  # this folder by its own name, from a checkout's root
    import os as _os

    from jaxserve.checkout import step_aside

    step_aside(__name__, _os.path.dirname(__file__))
