"""An OpenRouter-shaped provider simulator with ground-truth token ids and fault injection."""
