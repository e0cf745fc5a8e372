"""Reinforcement learning from verifiable rewards: a GRPO core whose pieces are chosen by
config strings (advantage estimators, per-token policy losses, loss aggregators, KL
estimators, rewards, buffer samplers), and the methods built from them: CCC-GRPO, PrefixRL,
multi-turn GRPO (MemoPilot), Q-PAS and counterfactual bonuses. See ``docs/rl.md``."""
