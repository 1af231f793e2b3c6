"""The HTTP front: OpenAI's API and Anthropic's Messages API over the serving core (app.py builds
the app; one module per API)."""
