"""What do plans cost, and do they hold? GPUs and feasibility of each placement algorithm, plans of random
fleets and thirty nights of re-planning checked again in the twin, and hostile inputs refused."""
