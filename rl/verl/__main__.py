"""`python -m rl.verl [overrides]`: verl's main_ppo with rl.verl.configure applied (see rl/verl/__init__.py)."""
from rl.verl.settings import main

main()
