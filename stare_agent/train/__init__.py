"""Training: the RL loop (``trainer``), the DeepSpeed learner that applies the algorithm
(``learner``), the token-exact batch it learns from (``batch``), cold-start SFT and its data
(``sft``, ``sft_data``), and the replay of saved rollouts under another algorithm (``replay``)."""
