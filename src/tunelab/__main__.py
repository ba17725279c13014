from tunelab import run

run()
