"""Agents that own their loop, run as agent episodes (docs/protocol.md#agent-episodes): the same
calculator task solved with the plain openai client, the OpenAI Agents SDK, LangGraph and a
process of its own. ``tasks.yaml`` runs them; ``calculator.py`` holds the task's tool and reward."""
