"""The Gradio UI and the Gradio routes it needs, answered in the one error shape."""
