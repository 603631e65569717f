"""The HTTP and OpenAI pieces that the node server and the proxy share: request and response
bodies, error bodies and handlers, admission guards, serving helpers, metric buckets. The proxy
imports these, never node/."""
