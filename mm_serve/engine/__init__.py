"""The engine: request objects, input processing, model runner and the step loop."""
