"""What two or more algorithms really share: payloads, tracking, persistence, site executors, training loops."""
