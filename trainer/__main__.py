"""``python -m trainer``: the built-in GPT trainer (see trainer.gpt)."""

from trainer.gpt import main

if __name__ == "__main__":
    main()
