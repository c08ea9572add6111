"""Learning for real: GRPO on SmolLM2-135M-Instruct, on CPU, through the rollout feed
(``make demo-learn``). One job per module:

- ``policy``: the model in PyTorch, loaded from the same GGUF file llama-server serves, and the
  logprobs of given token ids;
- ``gguf_weights``: the trained weights written back into a GGUF file llama-server loads;
- ``grpo``: the loss;
- ``llama``: the llama-server process, restarted on each new file (the weight sync);
- ``trainer``: the loop on the feed (take, check, loss, step, sync, publish, ack);
- ``evaluate``: held-out reward as an ordinary ``interactor run`` job;
- ``report``: summary.json and the plot;
- ``demo``: all of it, end to end (``python -m examples.learn.demo``).

torch, transformers, gguf and accelerate come with the ``learn`` extra (``pip install -e
.[learn]``); nothing of ``interactor`` needs them.
"""
