"""Our engine checked against llama.cpp reading the same GGUF (``python -m cloudd.llamacpp_agreement``).

Per plan prompt (the fleet demo's, plan-eval's), both sides read the same prompt token ids:

- **greedy**: both continue greedily for N tokens (EOS ignored); how many agree before the first
  difference, and both sides' top-2 log-prob margins where they part;
- **teacher forcing**: at every position of our greedy continuation, llama-server's top-1 for
  the same prefix against ours (one forward of ours over prompt + continuation); the share that
  agree, and each disagreement with both sides' margins (a near-tie under 0.5 nats).

``agreement`` compares, ``peer`` asks llama-server, ``prompts`` names the prompts, ``run`` ties
them together, ``report`` prints them.
"""
