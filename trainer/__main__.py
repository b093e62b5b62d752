"""``python -m trainer``: the built-in GPT trainer (see trainer.gpt)."""

from trainer.signals import install_early

install_early()  # before importing torch: a checkpoint request during start-up is kept, not fatal

if __name__ == "__main__":
    from trainer.gpt import main  # imports torch: only now, with the early signal handlers in place

    main()
