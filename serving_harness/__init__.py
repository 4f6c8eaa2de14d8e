"""Run real vLLM engines and measure them (launch, load, scrape, profile)."""
