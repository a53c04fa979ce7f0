"""Speculative decoding's drafting side: proposers draft k tokens per request, the target verifies them in one
forward (verification is the runner's sampling stage: brisk/model_runner/rejection_sampler.py).

- config.py: `SpeculativeConfig` (trtllm's `speculative_config` keys; vLLM's `--speculative-config` JSON maps onto it)
- proposer.py: the `Proposer` interface (`ProposeInputs` in, `DraftProposal` out)
- registry.py: `make_proposer`, the proposer `speculative_config` names
- ngram.py: prompt lookup (the longest recent suffix match in prompt + output)
- eagle.py: EAGLE3, a draft head on the target's hidden states (brisk/models/eagle3.py)
- drafter.py: `Drafter`, each speculative step's drafting side: record the accepted tokens, roll back, propose
"""
