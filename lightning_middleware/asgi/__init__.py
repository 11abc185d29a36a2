"""The HTTP layer the package's servers share, on raw ASGI: bearer-token and loopback checks
(`auth`), OpenAI-style JSON errors (`errors`), and whole or streamed replies (`replies`). The
gateway and the review page (`rewards.review`) both build on it, so neither imports the other."""
