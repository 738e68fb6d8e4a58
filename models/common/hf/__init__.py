"""What the Hugging Face adapters share: key names, config fields, the rotary permutation, RoPE reading, expert
layouts and the MoE adapter base."""
