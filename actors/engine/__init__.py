"""The replica engine: controller, workers, executors, sampling."""
