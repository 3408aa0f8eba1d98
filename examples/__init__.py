"""Models a new user could train and serve with the servemesh CLI alone."""
