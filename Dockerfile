# An image with this checkout installed, for the Kubernetes backend's rollout pods and the
# real-cluster test (docs/kubernetes.md). Not built by this project's CI (no Docker daemon on
# its machines): the emulated tests run the same worker entrypoint as a local process.
FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir ".[k8s,postgres,openai,langchain,dev]"
ENTRYPOINT ["lightning-mw"]
CMD ["rollouts", "worker", "--help"]
