"""The commands: simulate, deploy, erase, and the launchers and plots behind them."""
