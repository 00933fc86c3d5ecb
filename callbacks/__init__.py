"""Lightning callbacks for memopt, installed as ``memopt_plugins.callbacks``."""
