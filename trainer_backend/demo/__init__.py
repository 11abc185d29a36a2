"""`lightning-mw demo`: a LangChain tool agent trained with RL on CPU through the whole path."""
