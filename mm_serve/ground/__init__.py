"""The ground floor: the few plain types every floor shares (SLO tiers, SLOs in seconds,
worker roles, dtype names). It imports nothing of ours and nothing heavy."""
