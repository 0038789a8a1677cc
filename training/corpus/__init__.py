"""The real-job corpus: programs, the scripts that drive their memory, and the recorder."""
