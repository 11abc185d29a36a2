"""The heavy side: batch building, GRPO loss, training engines, weight publishing."""
