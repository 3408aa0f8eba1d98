"""The servemesh services (gateway, feature, model) and the runtime they share."""
