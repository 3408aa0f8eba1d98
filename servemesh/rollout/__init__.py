"""Progressive delivery: `servemesh rollout` moves a model's traffic to a new version step by
step, judging each step against the baseline, and rolls back on its own when a check fails."""
