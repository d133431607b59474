"""The continuous-time pricing market benchmark (issue 17).

``n`` firms with logit demand (Calvano et al., AER 2020) revise their prices on Poisson
clocks and see their competitors' prices ``latency`` time units late (arXiv 2606.09884).
:mod:`trainers.market.market` holds the one-shot market (demand, profits, the Nash and
monopoly benchmarks, the collusion index); :mod:`trainers.market.env` the market in
continuous time with exact profit integrals and semi-MDP transitions for each firm.
"""
