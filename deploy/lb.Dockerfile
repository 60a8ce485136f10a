# The one port in front of the replicas (8080), and one metrics port per replica (9101,
# 9102): nginx from Debian's packages.
FROM python:3.11-slim
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends nginx \
    && rm -rf /var/lib/apt/lists/*
COPY deploy/nginx.conf /etc/nginx/nginx.conf
EXPOSE 8080 9101 9102
CMD ["nginx", "-g", "daemon off;"]
