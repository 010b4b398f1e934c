# kvsidecar container image. The daemon needs no torch at run time beyond what nixl pulls in;
# GPU hosts add the `gpu` extra (cupy) for CUDA IPC import.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /opt/kvsidecar
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY kvsidecar ./kvsidecar
ARG EXTRAS=""
RUN pip install --no-cache-dir "./${EXTRAS}"
USER 65532:65532
EXPOSE 7100 9464
ENTRYPOINT ["kvsidecar"]
CMD ["serve", "--peer-listen", "0.0.0.0:7100", "--metrics-listen", "0.0.0.0:9464"]
