"""placeholder"""
def run(argv=None):
    return 0
