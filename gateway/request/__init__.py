"""A proxied request as the gateway reads it: which paths it proxies and how each names its model
(`surface`), a multipart form's field (`forms`), and the request read into one value (`call`)."""
