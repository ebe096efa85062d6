"""What the scripts share: common.py for Python, common.sh and heads.sh for the shell."""
